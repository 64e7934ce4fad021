#!/usr/bin/env python3
"""Generates reference/src/numerics/logfmt.rs's constants: LOG2_MANTISSA (log2(1 + m/128) rounded to
f32) and EXP2_POLY (a near-minimax fit of 2^f on [0, 1] with constant term 1, by iteratively
reweighted least squares on the relative error), printed as f32 bits. Plain Python, no numpy."""
import math, struct
from fractions import Fraction as F
def f32(x): return struct.unpack('<f', struct.pack('<f', x))[0]
def bits(x): return struct.unpack('<I', struct.pack('<f', x))[0]
# table
tab=[]
for m in range(128):
    v=math.log2(1+m/128)
    b=bits(v)
    # near-tie check: distance of v from the f32 rounding boundary
    lo=struct.unpack('<f',struct.pack('<I',b))[0]
    tab.append(b)
print("table", ", ".join("0x%08X"%b for b in tab))
# poly: p(f)=1+f*(a1+a2 f+...+a6 f^5); minimize relative error LSQ on chebyshev nodes, then iterate weights (Lawson) for near-minimax
N=400
nodes=[0.5-0.5*math.cos(math.pi*(i+0.5)/N) for i in range(N)]
deg=6
w=[1.0]*N
for it in range(30):
    # normal equations in floats (double) -- small system
    A=[[0.0]*deg for _ in range(deg)]; b=[0.0]*deg
    for x,wi in zip(nodes,w):
        t=2**x
        # residual r = (1 + sum a_j x^j - t)/t ; basis phi_j = x^j/t, target (t-1)/t
        phi=[x**(j+1)/t for j in range(deg)]
        y=(t-1)/t
        for i in range(deg):
            b[i]+=wi*phi[i]*y
            for j in range(deg): A[i][j]+=wi*phi[i]*phi[j]
    # solve with Fractions for stability
    M=[[F(A[i][j]) for j in range(deg)]+[F(b[i])] for i in range(deg)]
    for c in range(deg):
        p=max(range(c,deg),key=lambda r:abs(M[r][c])); M[c],M[p]=M[p],M[c]
        for r in range(deg):
            if r!=c:
                fct=M[r][c]/M[c][c]
                M[r]=[a-fct*bb for a,bb in zip(M[r],M[c])]
    a=[float(M[i][deg]/M[i][i]) for i in range(deg)]
    errs=[]
    for x in nodes:
        p=1+sum(a[j]*x**(j+1) for j in range(deg)); errs.append(abs(p/2**x-1))
    s=sum(wi*e for wi,e in zip(w,errs))
    w=[wi*e/s*N for wi,e in zip(w,errs)]
print("maxrel double", max(errs))
a32=[f32(c) for c in a]
print("coefs", [ "0x%08X"%bits(c) for c in a32], a32)
# f32 horner simulate with exact fma-rounding via Fraction
def rnd(q):
    return f32(float(q))  # double rounding risk ignore for check
mx=0
for i in range(200001):
    x=f32(i/200001)
    q=F(a32[5])
    for c in reversed(a32[:5]): q=F(rnd(q*F(x)+F(c)))
    p=rnd(q*F(x)+1)
    e=abs(p/2**x-1); mx=max(mx,e)
print("maxrel f32 horner", mx, "p(1)", p)
