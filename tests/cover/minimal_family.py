"""A small test-only pool family, written against the interface alone: dense attention, no host
pools, no fork and no PD transfer. It shows what a plug-in must provide and nothing more."""

from poolfuzz.errors import ConfigError
from poolfuzz.pools.allocator import TokenAllocator
from poolfuzz.pools.family import resolve_device
from poolfuzz.pools.kv import MHATokenToKVPool
from poolfuzz.pools.protocol import ServingProtocol
from poolfuzz.pools.req_to_token import ReqToTokenPool


class MinimalFamily:
    supports_fork = False
    supports_transfer = False
    uses_ssm_state = False
    backup_mode = "cpu_tensor"
    transfer = None
    host_pools: dict = {}

    def __init__(self, config, device):
        self.config = config
        self.device = device
        self.req_pool = ReqToTokenPool(size=config.request_rows, max_context=config.max_context, device=device)
        self.allocator = TokenAllocator(size=config.full_tokens, page_size=config.page_size)
        self.kv_pool = MHATokenToKVPool(size=config.full_tokens, layer_ids=config.full_layer_ids,
                                        page_size=config.page_size, dtype=config.kv_dtype, head_num=config.head_num,
                                        head_dim=config.head_dim, device=device)
        self.protocol = ServingProtocol()

    def components(self):
        return self.kv_pool.components()

    def host_components(self):
        return []

    def has_recurrent_state(self):
        return False

    def free_lists(self):
        return {"rows": self.req_pool.rows, "full": self.allocator}

    def set_free_listener(self, listener):
        for alloc in self.free_lists().values():
            alloc.on_free = listener


def unsupported_reason(config):
    if config.has_swa or config.has_mamba:
        return "the minimal family has dense attention only"
    return None


def build_minimal_family(config, *, device="cpu", faults=(), backup_mode=None):
    reason = unsupported_reason(config)
    if reason or faults or backup_mode not in (None, "cpu_tensor"):
        raise ConfigError(reason or "the minimal family takes no faults and only the cpu_tensor backup")
    return MinimalFamily(config, resolve_device(device))


build_minimal_family.unsupported_reason = unsupported_reason
