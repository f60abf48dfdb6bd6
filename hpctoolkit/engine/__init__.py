"""The vLLM side of capture: engine arguments, the capture engine and its KV connector.

`config` and `engine.build_llm_kwargs` import without vLLM; `engine.CaptureEngine` imports vLLM
when constructed; `connector` is loaded by vLLM itself (`kv_connector_module_path`).
"""
