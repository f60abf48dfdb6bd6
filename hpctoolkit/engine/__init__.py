"""The vLLM side of capture: engine arguments, the capture engine and its KV connector.

`config` and `engine.build_llm_kwargs` import without vLLM; `engine.CaptureEngine` imports vLLM
when constructed; `connector` is loaded by vLLM itself (`kv_connector_module_path`).
"""

# `hpctoolkit.config` must initialise before `hpctoolkit.engine.config`: importing the latter
# first otherwise runs into the config -> schema -> engine.config import cycle.
import hpctoolkit.config  # noqa: F401
