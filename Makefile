# Two commands are all a learner needs: `make lab` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch is pinned: this machine installs its local CPU wheel with exactly this pin, and an unpinned
# torch would pull gigabytes of CUDA packages. environment.yml pins the same (tests/test_project.py).
TORCH_VERSION := 2.13.0
# This machine's pip.conf makes pip print one "Location ... is ignored" warning per index location;
# drop those lines from stderr, keep everything else (pip's exit status is untouched).
PIP_FILTER := 2> >(grep -v 'is ignored' >&2)
# Which course_lib/bench/<WHAT>.py `make bench` runs, and its flags (e.g. ARGS="--ranks 2 --cold 1").
WHAT ?= launch
ARGS ?=

.PHONY: lab test solutions labs doctor install bench clean system-deps site

# constraints.txt is the tested set (pip freeze of the venv the suite passed in): a fresh install
# reproduces it instead of taking whatever the index serves that day.
# pip installs torch (it finds this machine's CPU wheel; see TORCH_VERSION) and uv, a pinned installer that
# puts the ~150 other packages in place at once (measured: 3.5 s against pip's 16 s, the same versions); if uv
# fails for any reason, pip installs them. Nothing is byte-compiled while installing: compileall does torch's
# files on every core (5 s) while the rest installs; the rest is compiled the first time it is imported, as
# Python does by default (see PYTHONDONTWRITEBYTECODE below). compileall's status is ignored: a few of torch's
# test helpers use Python 3.12 syntax and compile under neither (pip skips them too; nothing imports them).
UV_VERSION := 0.13.9
# Some environments set PYTHONDONTWRITEBYTECODE=1; then every process compiles every module it imports, every
# time. This Makefile's commands let Python write the bytecode of what they import, once: a whole test run
# imports ~4,100 of the ~8,300 modules outside torch, so compiling them all at install (15 s on 2 cores) cost
# more than compiling those when first needed.
unexport PYTHONDONTWRITEBYTECODE
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile "torch==$(TORCH_VERSION)" "uv==$(UV_VERSION)" $(PIP_FILTER)
	@$(PY) -m compileall -q -j 0 $(VENV)/lib/python3*/site-packages/torch \
		> /dev/null 2>&1 & compiling=$$!; \
	$(VENV)/bin/uv pip install -q --python $(PY) -c constraints.txt -e ".[test]" \
		|| $(PY) -m pip install -q --no-compile -c constraints.txt -e ".[test]" $(PIP_FILTER); status=$$?; \
	wait $$compiling; exit $$status
	@touch $(STAMP)

install: $(STAMP)

# JupyterLab on labs/, reachable from this machine only; token authentication stays on.
# Containers often run as root, which Jupyter refuses without --allow-root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
# nbgrader (the [test] extra: instructors and the suite) stays out of the learner's JupyterLab: its server
# extensions are switched off here, and its lab extension (menu, Create Assignment sidebar, Validate button) by
# lab_settings/page_config.json. tests/test_browser.py starts JupyterLab with these same options (`make -n lab`).
NO_NBGRADER := $(foreach e,formgrader validate_assignment assignment_list course_list,\
	--ServerApp.jpserver_extensions=nbgrader.server_extensions.$(e)=False)
lab: $(STAMP)
	$(PY) -m jupyter lab --ServerApp.root_dir=labs --ServerApp.ip=127.0.0.1 $(ALLOW_ROOT) \
		--LabApp.app_settings_dir=course_lib/widgets/lab_settings --LabApp.news_url= \
		--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate $(NO_NBGRADER)

system-deps:
	bash scripts/system-deps.sh

# Unit tests + nbval on solutions/ and labs/ (configured in pyproject.toml), on TEST_WORKERS
# pytest-xdist workers: one notebook or test file stays on one worker, in order, files are handed
# out longest first, and the tests marked `serial` run alone (root conftest.py).
# TEST_WORKERS=0 runs everything in one process.
# pytest's own exit status is kept in test-artifacts/pytest-exit-status for .ci/run (make only says 2).
TEST_WORKERS ?= 2
# The install and the Debian packages go side by side (-j 2): the install keeps the cores busy, apt-get mostly waits.
test:
	@$(MAKE) --no-print-directory -j 2 $(STAMP) system-deps
	@mkdir -p test-artifacts
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; status=$$?; \
		echo $$status > test-artifacts/pytest-exit-status; exit $$status

# Instructor run: every solution headless, then a table of status, seconds, backend and devices.
solutions: $(STAMP)
	$(PY) -m course_lib validate
	$(PY) -m course_lib run-solutions

labs: $(STAMP)
	$(PY) -m course_lib make-labs

# The course as a static website in site/: a front door (how to start, the total time, the syllabus), each solution
# with its outputs, the docs/ pages, the labs to download
# (nbconvert and a generated index: course_lib/apps/site.py). Open site/index.html, or copy site/ to any host.
site: $(STAMP)
	$(PY) -m course_lib site

doctor: $(STAMP)
	$(PY) -m course_lib doctor

bench: $(STAMP)
	$(PY) -m course_lib bench $(WHAT) $(ARGS)

clean:
	rm -rf $(VENV) test-artifacts .pytest_cache site
