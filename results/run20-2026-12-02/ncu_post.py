#!/usr/bin/env python3
"""Post-process an ncu report on the GPU host: per launch, export the SASS source page (csv),
identify the module by its instruction count, keep the first launch of each distinct count,
write per module: every instruction's address, SASS, and sample columns (compact csv)."""
import csv, io, subprocess, sys, os, collections
ncu, rep, out, nmax = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
seen = {}
log = open(os.path.join(out, "ncu_post.log"), "w")
for i in range(nmax):
    r = subprocess.run([ncu, "-i", rep, "--page", "source", "--csv", "--print-source", "sass",
                        "--launch-skip", str(i), "--launch-count", "1"], capture_output=True, text=True, timeout=120)
    txt = r.stdout
    if r.returncode != 0 or not txt.strip():
        log.write(f"launch {i}: rc {r.returncode} {r.stderr[:300]}\n"); break
    lines = [l for l in txt.splitlines() if l.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if not rows: log.write(f"launch {i}: no rows: {txt[:300]}\n"); continue
    hi = next((k for k, r in enumerate(rows) if any(c.strip() in ("Address", "Source") for c in r)), None)
    if hi is None: log.write(f"launch {i}: no header row: {rows[:3]}\n"); continue
    hdr = rows[hi]; body = rows[hi + 1:]
    n = len(body)
    log.write(f"launch {i}: {n} rows, header {hdr[:12]}\n")
    if n in seen: continue
    seen[n] = i
    keep = list(range(len(hdr)))
    with open(os.path.join(out, f"sass_{n}_launch{i}.csv"), "w") as f:
        w = csv.writer(f)
        w.writerow([hdr[j] for j in keep])
        for b in body: w.writerow([b[j] if j < len(b) else "" for j in keep])
log.write(f"modules: {seen}\n")
