#!/usr/bin/env bash
# Two builds of the gateway side by side: what a Wasm filter adds per request under load,
# for an earlier build (its `postern` and `posternctl` in OLD_BIN, its `header_injector`
# and `well_behaved` modules in OLD_MODULES) and this tree's release build. Both nodes run
# on CPU 1 (`--workers 1`, each idle while the other is measured), wrk and the nginx
# backend on CPU 0; each round measures every route of both nodes in turn (plain, native
# header filter, the two Wasm filters), so a drifting host moves both alike. Prints the
# node's CPU µs per request (from /proc), median and per round.
#
#   bash bench/wasm_ab.sh OLD_BIN OLD_MODULES      Env: ROUNDS (5), DUR (5s), CONN (50)
#
# To get an earlier build: git worktree add /tmp/old <commit>; ln -s "$PWD/target"
# /tmp/old/target; (cd /tmp/old && cargo build --release -p postern -p posternctl --bins &&
# make filters TARGET_DIR=/tmp/old-filters), then copy its binaries and modules out. The
# shared target dir saves rebuilding the dependencies, but cargo does not copy this
# tree's binaries back over the old ones when it has nothing to rebuild: this script
# touches their `main.rs` and refuses to run when the two binaries are the same.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -eq 2 ] || { echo "usage: $0 OLD_BIN OLD_MODULES" >&2; exit 2; }
old_bin=$(cd "$1" && pwd)
old_mods=$(cd "$2" && pwd)
touch "$root/host/src/main.rs" "$root/control/src/main.rs"
cargo build --release -p postern -p posternctl --bins >&2
if cmp -s "$old_bin/postern" "$root/target/release/postern"; then
  echo "$root/target/release/postern is the old build's binary" >&2; exit 1
fi
make -C "$root" filters >&2
lp=$(mktemp -d)
mk() { # tag ctl mods_dir
  local ctl=$2 mods=$3 work=$lp/$1
  rm -rf $work; mkdir -p $work/repo/platform $work/repo/teams/bench/filters
  printf 'clusters:\n  orders: { endpoints: ["127.0.0.1:18080"] }\n' > $work/repo/platform/clusters.yaml
  printf 'owners:\n  - { host: "*", pathPrefix: /, team: bench }\n' > $work/repo/platform/ownership.yaml
  route() { printf '  - name: %s\n    public: true\n    match: { path: { type: PathPrefix, value: %s } }\n    backendRefs: [{ name: orders }]\n    timeouts: { connect: 1s, response: 5s }\n    rewrite: { replacePrefixMatch: /v1/orders }\n%s\n' "$1" "$2" "${3:-}"; }
  { echo "routes:"; route plain /v1/plain; route native /v1/native $'    requestHeaders:\n      set: [{ name: x-bench, value: "1" }]'; } > $work/repo/teams/bench/routes.yaml
  echo "approved:" > $work/repo/platform/filters.yaml
  for n in header_injector well_behaved; do
    name=$(echo $n | tr '_' '-'); cp $mods/$n.wasm $work/repo/teams/bench/filters/$name.wasm
    echo "module: $name.wasm" > $work/repo/teams/bench/filters/$name.yaml
    echo "  - { digest: \"sha256:$(sha256sum $mods/$n.wasm | cut -d' ' -f1)\", filter: $name, team: bench }" >> $work/repo/platform/filters.yaml
    route "$name" "/v1/$name" "$(printf '    wasmFilters:\n      - name: %s\n        config: { set: { x-bench: "1" } }\n' "$name")" >> $work/repo/teams/bench/routes.yaml
  done
  $ctl compile $work/repo -o $work/snapshot.json >&2
}
mk old "$old_bin/posternctl" "$old_mods"
mk new "$root/target/release/posternctl" "$root/target/filters/wasm32-wasip2/release"
sed "s#@WORK@#$lp#g" "$root/../shared/bench/peers/backend.conf" > "$lp/backend.conf"
taskset -c 0 nginx -c "$lp/backend.conf" -g "pid $lp/b.pid;" &
backend=$!
POSTERN_LOG=warn taskset -c 1 "$old_bin/postern" --snapshot "$lp/old/snapshot.json" --public 127.0.0.1:18090 --admin 127.0.0.1:18092 --partner 127.0.0.1:18091 --workers 1 &
old=$!
POSTERN_LOG=warn taskset -c 1 "$root/target/release/postern" --snapshot "$lp/new/snapshot.json" --public 127.0.0.1:18190 --admin 127.0.0.1:18192 --partner 127.0.0.1:18191 --workers 1 &
new=$!
trap 'kill $old $new $backend 2>/dev/null; rm -rf "$lp"' EXIT
# Each node listens once its snapshot is built (its modules compiled and prepared).
for port in 18092 18192; do
  for _ in $(seq 120); do
    curl -sf -o /dev/null http://127.0.0.1:$port/healthz && break
    kill -0 $old $new 2>/dev/null || { echo "a node exited" >&2; exit 1; }
    sleep 0.25
  done
done
cpu_us() { # pid port path
  local b a out r
  b=$(awk '{print $14+$15}' /proc/$1/stat)
  out=$(taskset -c 0 wrk -t1 -c"${CONN:-50}" -d"${DUR:-5s}" "http://127.0.0.1:$2$3" 2>&1)
  a=$(awk '{print $14+$15}' /proc/$1/stat)
  r=$(echo "$out" | awk '/requests in/ {print $1}')
  echo "$out" | grep -q Non-2xx && echo "$3 on $2: $(echo "$out" | awk '/Non-2xx/ {print $NF}') non-2xx" >&2
  awk -v t=$((a - b)) -v r="$r" -v hz="$(getconf CLK_TCK)" 'BEGIN { printf "%.2f", t / hz / r * 1e6 }'
}
declare -A runs
for round in $(seq "${ROUNDS:-5}"); do
  for t in plain native header-injector well-behaved; do
    runs[old-$t]="${runs[old-$t]:-} $(cpu_us $old 18090 /v1/$t/1)"
    runs[new-$t]="${runs[new-$t]:-} $(cpu_us $new 18190 /v1/$t/1)"
  done
  echo "round $round" >&2
done
for k in old-plain new-plain old-native new-native old-header-injector new-header-injector old-well-behaved new-well-behaved; do
  m=$(printf '%s\n' ${runs[$k]} | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  printf '%-22s median %6s   runs:%s\n' $k $m "${runs[$k]}"
done
