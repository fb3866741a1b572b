#!/usr/bin/env bash
# Install promtool into DIR (default .tools) from Debian's `prometheus` package.
# Only the promtool binary is kept; nothing is installed system-wide. Idempotent: an existing
# working DIR/promtool is left alone. Fails loudly (non-zero exit, a message on stderr).
set -euo pipefail

dest="${1:-.tools}"
target="$dest/promtool"

die() {
    echo "install_promtool: error: $*" >&2
    exit 1
}

if [[ -x "$target" ]] && "$target" --version >/dev/null 2>&1; then
    exit 0
fi

command -v apt-get >/dev/null || die "apt-get not found (need a Debian/Ubuntu host, or put promtool at $target)"
command -v dpkg-deb >/dev/null || die "dpkg-deb not found"

mkdir -p "$dest"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
chmod 0755 "$work"  # apt's _apt user downloads into it when run as root

# apt-get update needs root; a non-root user may still have fresh lists.
if [[ "$(id -u)" == "0" ]]; then
    apt-get update -qq >/dev/null || die "apt-get update failed"
fi
(cd "$work" && apt-get download -qq prometheus >/dev/null 2>"$work/download.err") \
    || { cat "$work/download.err" >&2; false; } \
    || die "apt-get download prometheus failed (no network or no package lists?)"
deb="$(ls "$work"/prometheus_*.deb 2>/dev/null | head -n 1)"
[[ -n "$deb" ]] || die "apt-get download left no prometheus_*.deb"

dpkg-deb -x "$deb" "$work/root" || die "dpkg-deb -x $deb failed"
bin="$work/root/usr/bin/promtool"
[[ -f "$bin" ]] || die "the prometheus package has no usr/bin/promtool"

install -m 0755 "$bin" "$target.tmp"
mv -f "$target.tmp" "$target"
"$target" --version >/dev/null 2>&1 || die "$target does not run"
echo "install_promtool: $("$target" --version 2>&1 | head -n 1) -> $target"
