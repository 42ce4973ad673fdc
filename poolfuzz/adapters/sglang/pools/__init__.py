"""SGLang's KV and request pools as the family builds them, and the doors (writes, reads, paged calls) and views through which the harness reaches them."""
