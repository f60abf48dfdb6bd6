"""Methods vLLM mixes into every worker (`worker_extension_cls`), reachable by `collective_rpc`.

A multiprocess engine keeps stepping on its own, so the caller cannot see when the worker-side
connector has published a finished request; it asks the workers instead.
"""

from __future__ import annotations


class CaptureWorkerExtension:
    def hpctoolkit_published_count(self) -> int:
        """Samples this worker's connector reported published (0 on TP ranks other than 0)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return 0
        return int(getattr(get_kv_transfer_group(), "num_published", 0))
