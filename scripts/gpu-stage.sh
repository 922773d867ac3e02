# Sourced by the GPU scripts: `stage NAME SECONDS COMMAND...` runs a command with a time limit, logs it to
# $out/NAME.log and says how it ended ($out and $label set by the caller).
stage() {
  local name=$1 seconds=$2 start=$SECONDS
  shift 2
  timeout "$seconds" "$@" >"$out/$name.log" 2>&1
  echo "$label: $name ended with $? after $((SECONDS - start)) s (log: $out/$name.log)"
}
