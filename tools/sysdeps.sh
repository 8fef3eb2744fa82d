#!/usr/bin/env bash
# Installs the Debian packages listed in tools/apt-packages.txt that are not installed yet (as root, with
# apt-get). Without root or apt it says what is missing and carries on: the tests that need them say so.
set -euo pipefail
cd "$(dirname "$0")/.."
# One requirement a line: a package, or alternatives `a | b` (any installed one will do; else the first).
mapfile -t reqs < <(sed -e 's/#.*//' tools/apt-packages.txt | awk 'NF')
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
missing=()
for req in "${reqs[@]}"; do
  read -ra alts <<<"${req//|/ }"
  ok=0
  for p in "${alts[@]}"; do installed "$p" && { ok=1; break; }; done
  [ $ok = 1 ] || missing+=("${alts[0]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "sysdeps: not installed (needs root and apt-get): ${missing[*]}" >&2
  exit 0
fi
echo "sysdeps: installing ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
