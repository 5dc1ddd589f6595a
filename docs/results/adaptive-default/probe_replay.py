import json,glob,statistics as st,math,sys
def cv(x):
    m=st.fmean(x); return st.pstdev(x)/m
def mincv(r,B,B0):
    best=cv(r)
    for k in range(1,21):
        w=k/20
        best=min(best, cv([ri/((B0/b)**(w/2)) for ri,b in zip(r,B)]))
    return best
def verdict(row, corrected):
    n=row['norms_per_step']; sz=row['sizes']
    if len(n)<3: return None
    y=n[0]; B0=list(sz[0].values())[0]
    if len(set(sz[0].values()))!=1: return None
    def disp(k):
        names=[s for s in y if s in n[k] and s in sz[k] and y[s]>0]
        if len(names)<2: return None,None
        r=[n[k][s]/y[s] for s in names]; B=[sz[k][s] for s in names]
        d=mincv(r,B,B0) if corrected else cv(r)
        return d, st.fmean(r)
    d2,g2=disp(1)
    if d2 is None: return None
    if not (d2<0.15 and g2<3): return 'edge'
    if d2<0.075 and g2<1.2: return 'stable'
    d3,_=disp(2)
    if d3 is None: return None
    return 'stable' if d3<0.15 else 'edge'
for f in sorted(glob.glob('*.jsonl')):
    rows=[json.loads(l) for l in open(f) if json.loads(l)['policy']=='default']
    a=[verdict(r,False) for r in rows]; b=[verdict(r,True) for r in rows]
    rec=[r['regime'] for r in rows]
    print(f"{f:40s} recorded stable {rec.count('stable'):2d}/{len(rows)}  replay {a.count('stable'):2d}  corrected {b.count('stable'):2d}  (none {b.count(None)})")
