#!/usr/bin/env bash
# Debian's Chromium and its driver, for stage 15's browser test (tests/test_15_dashboard_browser.py).
# Idempotent: does nothing where both are installed; warns (and the test skips) where it cannot
# install them (not root, or no apt-get).
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing chromium and chromium-driver (Debian) for the browser test"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null
else
  echo "warning: no chromium/chromedriver, and no root apt-get to install them:" \
    "the browser test will skip" >&2
fi
