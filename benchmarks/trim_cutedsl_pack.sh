#!/usr/bin/env bash
# Trims the packed CuTeDSL wheels (.whl/cutlass_dsl.tar.zst, from ../shared/tools/pack_cutedsl.sh)
# so that they and the working tree fit one device call (64 MiB in all): drops the in-kernel
# event tracer `iket` (cutlass imports it only on use, behind a guard) and the aarch64 / QNX
# runtime stubs. Run from the repository root:  bash benchmarks/trim_cutedsl_pack.sh
set -euo pipefail
PACK=.whl/cutlass_dsl.tar.zst
[ -s "$PACK" ] && [ -x .whl/zstd ] || { echo "no $PACK: run ../shared/tools/pack_cutedsl.sh first" >&2; exit 1; }
grep -q trimmed .whl/cutlass_dsl.version 2>/dev/null && { echo "already trimmed"; exit 0; }
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && "$OLDPWD/.whl/zstd" -dc --long=28 "$OLDPWD/$PACK" | tar xf -)
rm -rf "$TMP/nvidia_cutlass_dsl/dsl_packages/iket" "$TMP/nvidia_cutlass_dsl/cu13/lib/stubs"
(cd "$TMP" && tar cf - . | "$OLDPWD/.whl/zstd" -q -f --ultra -22 --long=28 -T0 -o "$OLDPWD/$PACK.new")
mv "$PACK.new" "$PACK"
echo "$(head -1 .whl/cutlass_dsl.version) trimmed" > .whl/cutlass_dsl.version
du -cb .whl/* | tail -1
