"""Imported at start-up by every Python process the tests launch (tests/conftest.py puts
this folder first on PYTHONPATH): vLLM's EngineCore and workers, servers, CLI jobs, Ray.

At exit such a process holds ~800k objects (torch, vLLM, transformers), and the
interpreter's final garbage collections walk them all: ~2.3 s per process on the 2-core
CI hosts, paid twice per engine shutdown (worker, then EngineCore; vLLM's 5 s grace then
kills the EngineCore). Frozen objects are left to the OS instead, as os._exit would; the
interpreter still runs atexit handlers and closes what reference counting frees.
"""

import atexit
import gc

atexit.register(gc.freeze)  # registered first, so it runs after every other exit handler
