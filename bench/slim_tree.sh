#!/usr/bin/env bash
# Keep tracked files out of the device tool's copy of this checkout for one call. The tool copies the
# tracked files, the untracked ones git does not ignore and the `carry` paths, 64 MiB in all; the weights
# in models-shipped/ and models-candidates/ (~19 MB each) plus a checkpoint carried back from the last call
# do not fit. A call that starts from carried weights does not need the candidate it replaces.
#
#   bash bench/slim_tree.sh hide PATH...   # untrack PATHs in the index only and ignore them (files stay)
#   bash bench/slim_tree.sh restore        # back in the index as HEAD has them; the ignore lines removed
#   bash bench/slim_tree.sh status         # what is hidden, and the bytes the tool would copy
#
# Never commit between hide and restore: the commit would delete the hidden paths. `hide` refuses while
# anything is staged (so a restore cannot drop staged work) and `restore` is safe to run twice. The
# ignore lines live in .git/info/exclude (never committed) between two marker lines.
set -uo pipefail
cd "$(git rev-parse --show-toplevel)" || exit 2
EXCLUDE=$(git rev-parse --git-path info/exclude)
BEGIN="# bench/slim_tree.sh: hidden from the device copy (restore before committing)"
END="# bench/slim_tree.sh: end"

hidden() {
  [ -f "$EXCLUDE" ] || return 0
  sed -n "\|^$BEGIN\$|,\|^$END\$|p" "$EXCLUDE" | grep -v '^#' | sed 's|^/||; s|/$||'
}

copied_bytes() {
  # tracked plus untracked-not-ignored files: what the device tool copies before `carry`
  { git ls-files -z; git ls-files -z --others --exclude-standard; } |
    xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}'
}

case "${1:-status}" in
hide)
  shift
  [ $# -gt 0 ] || { echo "slim_tree: hide needs one or more tracked paths" >&2; exit 2; }
  git diff --cached --quiet || { echo "slim_tree: the index has staged changes; commit or unstage them first" >&2; exit 2; }
  for p in "$@"; do
    p=${p%/}
    [ -n "$(git ls-files -- "$p")" ] || { echo "slim_tree: $p is not tracked" >&2; exit 2; }
  done
  mkdir -p "$(dirname "$EXCLUDE")"
  grep -qxF "$BEGIN" "$EXCLUDE" 2>/dev/null || printf '%s\n%s\n' "$BEGIN" "$END" >>"$EXCLUDE"
  for p in "$@"; do
    p=${p%/}
    git rm -q -r --cached -- "$p" || exit 1
    [ -d "$p" ] && line="/$p/" || line="/$p"
    sed -i "\|^$END\$|i $line" "$EXCLUDE"
  done
  echo "hidden: $(hidden | tr '\n' ' ')"
  echo "the device tool copies $(copied_bytes) bytes before carry (limit 67108864 with it); restore before committing"
  ;;
restore)
  mapfile -t paths < <(hidden)
  [ ${#paths[@]} -eq 0 ] || git reset -q HEAD -- "${paths[@]}" || exit 1
  [ -f "$EXCLUDE" ] && sed -i "\|^$BEGIN\$|,\|^$END\$|d" "$EXCLUDE"
  echo "restored: ${paths[*]:-nothing was hidden}"
  ;;
status)
  echo "hidden: $(hidden | tr '\n' ' ')"
  echo "the device tool copies $(copied_bytes) bytes before carry"
  ;;
*)
  echo "slim_tree: unknown command ${1} (hide PATH..., restore, status)" >&2
  exit 2
  ;;
esac
