#!/usr/bin/env bash
# The browser tests/test_ui.py drives: Debian's chromium (Playwright's own download needs the
# internet). Installed once with apt-get, as root or through sudo; a no-op where it is installed.
set -euo pipefail
command -v chromium >/dev/null 2>&1 && exit 0
echo "knnlm-serve tests: installing Debian's chromium for the page's browser tests (tests/test_ui.py)"
SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo "sudo")
$SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null \
    || { echo "could not install chromium: install Debian's chromium package, or tests/test_ui.py fails" >&2; exit 0; }
