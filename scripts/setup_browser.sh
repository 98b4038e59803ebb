#!/usr/bin/env bash
# Debian's chromium + chromium-driver for the web page's browser test (tests/test_webui_browser.py):
# installed when missing and this shell is root with apt-get; otherwise it says why and the test skips.
#   bash scripts/setup_browser.sh
set -uo pipefail
have() { command -v "$1" >/dev/null 2>&1; }
if have chromedriver && { have chromium || have chromium-browser; }; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! have apt-get; then
  echo "setup_browser: chromium + chromium-driver are missing and this is not a root shell with apt-get;" \
       "the browser test will be skipped"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
install() { apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null 2>&1; }
install || { apt-get update -q >/dev/null 2>&1 && install; } \
  || echo "setup_browser: apt-get could not install chromium chromium-driver; the browser test will be skipped"
exit 0
