import sys, time, cProfile, pstats, io
sys.path.insert(0, "benchmarks")
import torch
import hf_train_step as h

def run(name):
    model, _ = h.build(name, None, "llama")
    fwd = h.prepare(model, name, "llama", 0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    ids = torch.randint(0, 128000, (1, 8192), device="cuda")
    def step(split=None):
        t0 = time.perf_counter()
        loss = fwd(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step(); opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if split is not None: split.append((t1-t0, t2-t1, t3-t2))
    for _ in range(4): step()
    import coda_lang.torch as ct; ct.wait_for_kernels()
    for _ in range(2): step()
    torch.cuda.synchronize()
    sp = []
    for _ in range(4):
        step(sp); torch.cuda.synchronize()
    print(name, "host fwd/bwd/opt ms:", [tuple(round(x*1e3,1) for x in s) for s in sp])
    pr = cProfile.Profile(); pr.enable(); step(); pr.disable(); torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        out = io.StringIO(); pstats.Stats(pr, stream=out).sort_stats(key).print_stats(45)
        txt = out.getvalue()
        print("\n".join(l[:170] for l in txt.splitlines()[6:60]))
    del model, fwd, opt; torch.cuda.empty_cache()

for n in sys.argv[1:]:
    run(n)
