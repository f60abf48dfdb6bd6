"""Serve an exported draft with its target in vLLM and measure acceptance; compare with the trainer's.

    python -m hpctoolkit.evaluate EXPORT_DIR --target TARGET_DIR [--num-prompts 8]
        [--prompts builtin:tiny|FILE.jsonl] [--num-speculative-tokens 3] [--max-tokens 48]
        [--out evaluate.json] [--plot evaluate.png]

Two numbers, on the same prompts and the same tokens: **served** (`serve.py`: vLLM's greedy
speculative decoding and its counters, every draft parameter audited as loaded) and
**simulated** (`simulate.py`: the trainer's own metric over the served tokens, with vLLM's
verification schedule replayed). `compare.py` puts them side by side; `__main__.py` is the CLI.
"""

from hpctoolkit.evaluate.compare import CONVENTION, evaluate

__all__ = ["CONVENTION", "evaluate"]
