"""Test helpers, imported as `from helpers.<module> import ...` (pytest puts tests/ on sys.path).

daemon        start `edged serve` as a real process; metrics and systemd-notify readers
fake_engine   a fake engine implementing EngineClient, and an HTTP/3 server on its own thread
char_tokenizer  one token per character, for text-assembly tests
aio           run(coro, timeout): a test's coroutine on a fresh loop, bounded
tiny_engine   a tiny random-weight engine on the CPU with the real engine parts
sysfs         fake /sys PCI trees for topology tests
kernel_inputs random kernel inputs (quantized weights, a paged KV cache) on any device
gguf          llama.cpp's q/k row permutation, to check the loaders undo it
cache_writer  a script that writes result-cache entries until it is killed
interpreted_child  a test file's child pytest run under Triton's interpreter, started early
"""
