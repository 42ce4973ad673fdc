"""HiCache's host and storage tiers on the CPU: host pools, the retraction backup, L3 backends and the transfer kernels' byte copies."""
