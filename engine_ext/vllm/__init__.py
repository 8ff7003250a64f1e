"""Every touch of vLLM internals, split by concern, behind the supported-version check
(version.check_vllm_version)."""
