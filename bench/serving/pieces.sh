# Shared by the bench scripts that carry files to a GPU machine in pieces (bench/serving/serving_h200.sh,
# bench/serving/vllm_h200.sh): source it after setting W.
#
#   W=/tmp/ipw-serving; source bench/serving/pieces.sh
#
# Output: none (functions for bench/serving/serving_h200.sh and bench/serving/vllm_h200.sh).

stash() {  # copy each folder's files to $W/parts and check them against its parts.sha256
  mkdir -p "$W/parts"
  local d
  for d in "$@"; do
    [ -d "$d" ] || { echo "stash: no folder $d" >&2; exit 2; }
    find "$d" -maxdepth 1 -type f -exec cp {} "$W/parts/" \;
    if [ -f "$d/parts.sha256" ]; then
      (cd "$W/parts" && grep -F -f <(cd "$d" && ls) parts.sha256 | sha256sum -c --quiet -) || { echo "stash: $d: a piece is damaged" >&2; exit 1; }
    fi
    echo "stashed $(find "$d" -maxdepth 1 -type f | wc -l) files of $d in $W/parts"
  done
}
