# Shared by the GPU hand-off scripts (gpu_genperf.sh, gpu_sp_qos.sh): `. bench/parts.sh` from the repo root.
#   parse_args DEFAULT_PARTS "$@"   --only A,B (default DEFAULT_PARTS) -> $ONLY, --smoke -> SMOKE=1;
#                             OUT defaults to ./out (created)
#   run PART NAME LIMIT_S CMD...   runs CMD --json $OUT/NAME.json under a time limit if PART is in $ONLY;
#                             stdout to $OUT/NAME.md, stderr to $OUT/NAME.err; a part that fails or times
#                             out is reported and added to $FAILED, the others still run
#   finish ALL_NAME           merges $OUT/*.json into $OUT/ALL_NAME.json; exit status 1 if a part failed
FAILED=""
parse_args() {
  ONLY="$1"; SMOKE=0; shift
  while [ $# -gt 0 ]; do
    case "$1" in
      --only) ONLY="$2"; shift 2 ;;
      --smoke) SMOKE=1; shift ;;
      *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
  done
  OUT="${OUT:-./out}"
  mkdir -p "$OUT"
}

run() {
  local part="$1" name="$2" limit="$3"; shift 3
  case ",$ONLY," in *",$part,"*) ;; *) return 0 ;; esac
  echo; echo "## $name"
  local t0=$SECONDS
  if timeout --signal=INT --kill-after=20 "$limit" "$@" --json "$OUT/$name.json" 2>"$OUT/$name.err" | tee "$OUT/$name.md"; then
    echo "($name: $((SECONDS - t0)) s)"
  else
    echo "PART $name FAILED or timed out after $((SECONDS - t0)) s; last lines of $OUT/$name.err:"
    tail -n 20 "$OUT/$name.err" || true
    FAILED="$FAILED $name"
  fi
}

finish() {
  python - "$OUT" "$1" <<'PYEOF'
import json, os, sys
out, all_name = sys.argv[1], sys.argv[2]
res = {}
for name in sorted(os.listdir(out)):
    if name.endswith(".json") and name != f"{all_name}.json":
        try:
            res[name[:-5]] = json.load(open(os.path.join(out, name)))
        except ValueError:
            pass
json.dump(res, open(os.path.join(out, f"{all_name}.json"), "w"), indent=2, default=str)
print(f"\nwrote {os.path.join(out, all_name + '.json')} ({', '.join(res)})")
PYEOF
  if [ -n "$FAILED" ]; then
    echo "failed parts:$FAILED"
    exit 1
  fi
}
