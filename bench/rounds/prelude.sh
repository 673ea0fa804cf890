# Sourced by round scripts from s50 on: the set-up every device call repeats (unbuffered output, the carried
# Triton cache unpacked, the package installed in place) and `pack DIR...`, which replaces output
# directories under $OUT by one archive (the device returns at most 8 files a call).
set -u
export TRITON_CACHE_DIR=/tmp/t/triton-cache PYTHONUNBUFFERED=1
mkdir -p /tmp/t && { [ ! -f .cache/triton-cache.tgz ] || tar -xzf .cache/triton-cache.tgz -C /tmp/t; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
pack() {  # pack NAME DIR...: $OUT/NAME.tgz from the directories under $OUT, which are then removed
  local name=$1; shift
  tar -czf "$OUT/$name.tgz" -C "$OUT" "$@" && (cd "$OUT" && rm -rf "$@")
}
prof_step() {  # prof_step ARCHIVE [ENV=VALUE...]: the 128K batch-1 decode profile into $OUT/ARCHIVE.tgz
  local name=$1; shift
  env "$@" python3 -m bench.step_profile --phase decode --tokens 131072 --steps 96 --out $OUT/$name \
    | grep -E "^decode batch|decode run plain"
  pack $name $name
}
