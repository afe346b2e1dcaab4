#!/usr/bin/env python3
"""gguf_edit.py — one planted change in a GGUF file, for the sweeps
(bench/xrt_sweep.sh, bench/verdict_sweep.sh): standard library only.

    gguf_edit.py meta IN OUT KEY VALUE        a u32 or f32 metadata value set;
                                              KEY[I]: element I of an array
                                              (bool, u8, i32, u32 or f32)
    gguf_edit.py swap IN OUT NAME1 NAME2      two f32 tensors trade their data
    gguf_edit.py add IN OUT PART VALUE        every f32 tensor whose name holds
    gguf_edit.py mul IN OUT PART VALUE        PART: VALUE added / multiplied
    gguf_edit.py unpermute IN OUT PART D      q/k rows back to Hugging Face's
                                              order (head_dim D)
"""
import struct,sys
mode,fn,out,a1,a2=sys.argv[1:6]
b=bytearray(open(fn,'rb').read())
nt,nkv=struct.unpack_from('<QQ',b,8); o=24; align=32
size={0:1,1:1,2:2,3:2,4:4,5:4,6:4,7:1,10:8,11:8,12:8}
def skip(t,o):
    if t==8: return o+8+struct.unpack_from('<Q',b,o)[0]
    if t==9:
        at,n=struct.unpack_from('<IQ',b,o); o+=12
        for _ in range(n): o=skip(at,o)
        return o
    return o+size[t]
for _ in range(nkv):
    n=struct.unpack_from('<Q',b,o)[0]; k=b[o+8:o+8+n].decode(); o+=8+n
    t=struct.unpack_from('<I',b,o)[0]; o+=4
    if k=='general.alignment': align=struct.unpack_from('<I',b,o)[0]
    if mode=='meta' and k==a1:
        struct.pack_into('<I' if t==4 else '<f',b,o,int(float(a2)) if t==4 else float(a2))
    if mode=='meta' and '[' in a1 and k==a1[:a1.index('[')] and t==9:
        at,n=struct.unpack_from('<IQ',b,o); i=int(a1[a1.index('[')+1:-1])
        fmt={0:'<B',7:'<B',4:'<I',5:'<i',6:'<f'}[at]; assert 0<=i<n
        struct.pack_into(fmt,b,o+12+i*size[at],float(a2) if at==6 else int(float(a2)))
    o=skip(t,o)
tensors=[]
for _ in range(nt):
    n=struct.unpack_from('<Q',b,o)[0]; name=b[o+8:o+8+n].decode(); o+=8+n
    nd=struct.unpack_from('<I',b,o)[0]; o+=4
    dims=struct.unpack_from('<%dQ'%nd,b,o); o+=8*nd
    t,off=struct.unpack_from('<IQ',b,o); o+=12
    tensors.append((name,dims,t,off))
data=(o+align-1)//align*align
if mode=='swap':   # the F32 tensors named exactly a1 and a2 trade their data
    (d1,n1),(d2,n2)=[(data+off,4*eval('*'.join(map(str,dims)))) for nm in (a1,a2)
                     for name,dims,t,off in tensors if name==nm]
    assert n1==n2
    b[d1:d1+n1],b[d2:d2+n2]=b[d2:d2+n2],b[d1:d1+n1]
for name,dims,t,off in tensors:
    if mode in ('meta','swap') or a1 not in name or t!=0: continue
    ne0=dims[0]; cnt=1
    for d in dims: cnt*=d
    at=data+off; x=list(struct.unpack_from('<%df'%cnt,b,at))
    if mode=='mul':
        x=[v*float(a2) for v in x]
    elif mode=='add':
        x=[v+float(a2) for v in x]
    else:   # unpermute: row 2j+t of each head back to t*D/2+j
        D=int(a2); h=D//2; y=x[:]
        for r0 in range(0,cnt//ne0,D):
            for j in range(h):
                for s in range(2):
                    src=(r0+2*j+s)*ne0; dst=(r0+s*h+j)*ne0
                    y[dst:dst+ne0]=x[src:src+ne0]
        x=y
    struct.pack_into('<%df'%cnt,b,at,*x)
open(out,'wb').write(b)
