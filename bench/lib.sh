# Helpers the interleaved load benchmarks share (sourced by metering.sh and protect.sh):
# a proxy's CPU time per request under wrk, and a median.

ticks() { # utime+stime of a pid and its children
  local t=0 p
  for p in $1 $(pgrep -P "$1" 2>/dev/null); do
    [ -r /proc/$p/stat ] && t=$((t + $(awk '{print $14+$15}' /proc/$p/stat)))
  done
  echo $t
}
run() { # pid url [header] -> the pid's CPU µs per request under wrk on CPU 0, and the non-2xx count
  local before after out reqs non2xx
  before=$(ticks "$1")
  out=$(taskset -c 0 wrk -t1 -c"${CONN:-50}" -d"${DUR:-10s}" ${3:+-H "$3"} "$2" 2>&1)
  after=$(ticks "$1")
  reqs=$(echo "$out" | awk '/requests in/ {print $1}')
  non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
  awk -v t=$((after - before)) -v r="$reqs" -v hz="$(getconf CLK_TCK)" -v e="${non2xx:-0}" \
    'BEGIN{ printf "%.2f %s\n", (r > 0 ? t / hz / r * 1e6 : 0), e }'
}
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2)}'; }
