#!/usr/bin/env python3
"""Control-plane benchmark: compile + validate a repository of 5,000 routes in 300 team
directories; snapshot and credential sizes; node boot time from disk with 5 k routes and
100 k keys; fast-lane propagation (a change accepted → applied on every node) to N local
nodes, with a small and a 100 k-key credential state.

Usage: bench/control.py [--bin DIR] [--nodes 4,8] [--ops 100]
Needs the release binaries (`cargo build --release -p postern -p posternctl --bins`).
Everything runs on 127.0.0.1 with ephemeral ports; prints a Markdown table.
"""

import argparse
import hashlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEAMS = 300
ROUTES = 5000
KEYS = 100_000
PLATFORM_TOKEN = "bench-platform-token"
NODE_TOKEN = "bench-node-token"


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def make_repo(root, keys):
    """300 teams, 5,000 routes with a realistic mix of matches, auth and limits."""
    clusters = "".join(f"  svc-{i:03d}: {{ endpoints: [\"127.0.0.1:{20000 + i}\"] }}\n" for i in range(TEAMS))
    write(f"{root}/platform/clusters.yaml", "clusters:\n" + clusters)
    owners = "".join(f"  - {{ host: \"*\", pathPrefix: /v1/svc-{i:03d}, team: team-{i:03d} }}\n" for i in range(TEAMS))
    write(f"{root}/platform/ownership.yaml", "owners:\n" + owners)
    write(
        f"{root}/platform/plans.yaml",
        "scopes: [read, write]\nproducts: [core]\nplans:\n"
        "  free: { products: [core], rateLimit: { rps: 10, burst: 20 } }\n"
        "  partner: { products: [core], rateLimit: { rps: 1000, burst: 2000 } }\n",
    )
    n = 0
    for t in range(TEAMS):
        count = ROUTES // TEAMS + (1 if t < ROUTES % TEAMS else 0)
        lines = ["routes:\n"]
        for r in range(count):
            n += 1
            base = f"/v1/svc-{t:03d}/res-{r}"
            kind = r % 4
            if kind == 0:
                m = f"match: {{ path: {{ value: {base} }}, methods: [GET] }}"
            elif kind == 1:
                m = f"match: {{ path: {{ type: Exact, value: \"{base}/{{id}}\" }}, methods: [GET, PUT] }}"
            elif kind == 2:
                m = f"match: {{ path: {{ value: {base} }}, version: {{ header: x-api-version, value: \"2\" }} }}"
            else:
                m = f"match: {{ path: {{ type: Exact, value: {base}/search }}, methods: [POST] }}"
            auth = (
                "    public: true\n"
                if r % 3 == 0
                else "    auth: { methods: [apiKey, jwt], scopes: [read], product: core }\n"
                "    rateLimit: { class: default, cost: 1 }\n"
            )
            lines.append(
                f"  - name: r{r}\n    {m}\n{auth}    backendRefs: [{{ name: svc-{t:03d} }}]\n"
                "    timeouts: { connect: 1s, response: 5s }\n"
            )
        write(f"{root}/teams/team-{t:03d}/routes.yaml", "".join(lines))
    if keys:
        with open(f"{root}/platform/keys.jsonl", "w") as f:
            for i in range(keys):
                digest = hashlib.sha256(secrets.token_bytes(24)).hexdigest()
                rec = {"id": f"k{i}", "sha256": digest, "app": f"app-{i % 5000}", "tenant": f"tenant-{i % 2000}",
                       "plan": "partner" if i % 10 else "free", "scopes": ["read"]}
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    return n


def timed(cmd):
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{cmd}: {out.stderr}")
    return time.perf_counter() - t


def http(method, url, token=None, body=None, timeout=60):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if token:
        req.add_header("authorization", f"Bearer {token}")
    req.add_header("content-type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def wait_file(path, proc, what):
    end = time.time() + 60
    while not (os.path.exists(path) and os.path.getsize(path) > 0):
        if proc.poll() is not None:
            sys.exit(f"{what} exited")
        if time.time() > end:
            sys.exit(f"{what} did not start")
        time.sleep(0.002)
    with open(path) as f:
        return f.read()


def start_node(bindir, work, name, snapshot, extra):
    os.makedirs(work, exist_ok=True)
    ports = f"{work}/ports.json"
    if os.path.exists(ports):
        os.remove(ports)
    cmd = [f"{bindir}/postern", "--snapshot", snapshot, "--public", "127.0.0.1:0", "--partner", "127.0.0.1:0",
           "--admin", "127.0.0.1:0", "--workers", "1", "--ports-file", ports, "--node-id", name] + extra
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(f"{work}/log", "w"))
    p = json.loads(wait_file(ports, proc, name))
    return proc, p, time.perf_counter() - t


def boot(bindir, work, out, runs=3):
    """Time from exec to a node ready with the snapshot and the credential state live."""
    times = []
    for i in range(runs):
        t = time.perf_counter()
        proc, p, _ = start_node(bindir, f"{work}/boot{i}", f"boot-{i}", f"{out}/snapshot.json",
                                ["--credentials", f"{out}/credentials.json"])
        while True:
            try:
                r = http("GET", f"http://127.0.0.1:{p['admin']}/readyz")
                if r["credentials"]["keys"] == KEYS and r["snapshot"]["routes"] > 0:
                    break
            except Exception:
                pass
            time.sleep(0.002)
        times.append(time.perf_counter() - t)
        proc.kill()
        proc.wait()
    return times


def fast_lane(bindir, work, repo, nodes, ops):
    """p50/p99 of key-service changes answered once every live node applied them."""
    os.makedirs(work, exist_ok=True)
    tokens = f"{work}/tokens.json"
    h = lambda t: hashlib.sha256(t.encode()).hexdigest()
    with open(tokens, "w") as f:
        json.dump([{"name": "bench", "role": "platform", "sha256": h(PLATFORM_TOKEN)},
                   {"name": "nodes", "role": "node", "sha256": h(NODE_TOKEN)}], f)
    cp = subprocess.Popen([f"{bindir}/posternctl", "serve", repo, "--store", f"{work}/store", "--tokens", tokens,
                           "--listen", "127.0.0.1:0", "--dwell", "0s"], stdout=subprocess.PIPE,
                          stderr=open(f"{work}/cp.log", "w"), text=True)
    url = "http://" + cp.stdout.readline().strip()
    procs = []
    try:
        http("POST", f"{url}/v1/publish", PLATFORM_TOKEN)
        for i in range(nodes):
            d = f"{work}/n{i}"
            proc, _, _ = start_node(bindir, d, f"node-{i}", f"{d}/snapshot.json",
                                    ["--control", url, "--control-token", NODE_TOKEN])
            procs.append(proc)
        end = time.time() + 120
        while True:
            s = http("GET", f"{url}/v1/status", PLATFORM_TOKEN)
            if s["nodes_on_credentials"] == nodes and s["nodes_on_snapshot"] == nodes:
                break
            if time.time() > end:
                sys.exit(f"nodes did not come up: {s}")
            time.sleep(0.05)
        took, stale = [], 0
        for i in range(ops):
            t = time.perf_counter()
            r = http("POST", f"{url}/v1/deny?wait_acks=10", PLATFORM_TOKEN, {"jti": f"bench-{i}-{secrets.token_hex(4)}"})
            took.append(time.perf_counter() - t)
            stale += len(r["credentials"].get("stale", []))
        return took, stale
    finally:
        for p in procs:
            p.kill()
        cp.kill()
        for p in procs + [cp]:
            p.wait()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", f"{ROOT}/target"), "release"))
    ap.add_argument("--nodes", default="4,8")
    ap.add_argument("--ops", type=int, default=100)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="postern-control-bench-")
    rows = []
    print("| measure | figure |\n|---|---|", flush=True)

    class Rows(list):
        def append(self, row):
            print(f"| {row[0]} | {row[1]} |", flush=True)
            super().append(row)

    rows = Rows()
    try:
        small = f"{work}/repo-small"
        big = f"{work}/repo-100k"
        n = make_repo(small, 0)
        make_repo(big, KEYS)
        ctl = f"{a.bin}/posternctl"
        os.makedirs(f"{work}/out-small", exist_ok=True)
        os.makedirs(f"{work}/out", exist_ok=True)
        runs = [timed([ctl, "compile", small, "-o", f"{work}/out-small/snapshot.json"]) for _ in range(3)]
        rows.append((f"compile + validate {n} routes, {TEAMS} teams", f"{statistics.median(runs) * 1e3:.0f} ms (runs: "
                     + ", ".join(f"{r * 1e3:.0f}" for r in runs) + ")"))
        runs = [timed([ctl, "compile", big, "-o", f"{work}/out/snapshot.json"]) for _ in range(3)]
        rows.append((f"compile + validate {n} routes and {KEYS} keys", f"{statistics.median(runs) * 1e3:.0f} ms"))
        size = os.path.getsize(f"{work}/out/snapshot.json")
        csize = os.path.getsize(f"{work}/out/credentials.json")
        rows.append(("snapshot size (5 k routes)", f"{size / 1e6:.2f} MB"))
        rows.append(("credentials size (100 k keys)", f"{csize / 1e6:.1f} MB"))
        b = boot(a.bin, work, f"{work}/out")
        rows.append(("node boot from disk, 5 k routes + 100 k keys (exec → ready)",
                     f"{statistics.median(b) * 1e3:.0f} ms (runs: " + ", ".join(f"{x * 1e3:.0f}" for x in b) + ")"))
        for repo, label in [(small, "small credential state"), (big, "100 k keys")]:
            for nodes in [int(x) for x in a.nodes.split(",")]:
                took, stale = fast_lane(a.bin, f"{work}/fl-{label[:5]}-{nodes}", repo, nodes, a.ops)
                rows.append((f"fast lane, {nodes} nodes, {label}: accepted → applied on all ({a.ops} changes)",
                             f"p50 {pct(took, 0.5) * 1e3:.0f} ms, p99 {pct(took, 0.99) * 1e3:.0f} ms, "
                             f"max {max(took) * 1e3:.0f} ms; stale answers {stale}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
