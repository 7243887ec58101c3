"""Multi-GPU head-to-head of freescale_comm against NCCL, in one call (issue 5).

One process per GPU, started by the one rank launcher (``freescale_comm._local_ranks``: a
store on loopback, every run bounded, each rank's traceback). In each process the default
group is ``backend="freescale"`` forced to the direct CUDA path, a second freescale group forces
the staged path (both through ``FreescaleOptions`` as ``pg_options``), an NCCL group lives beside
them, and a Gloo group carries this script's own barriers and agreements. Each part runs in
try/except and inside a global time budget (parts that no longer fit are skipped and say so):

1. setup: versions, GPU links (``nvidia-smi topo -m``), a freescale and an NCCL group in one
   process, the path of each peer pair per freescale group (``paths()``: on one host the staged
   group moves CUDA bytes through the staging rings, page-locked shared memory), the symmetric
   buffers of the NCCL copy-engine variant;
2. correctness: every own collective of freescale (IPC, direct and staged) on CUDA tensors
   between the GPUs, float32 / bfloat16 / int64, against NCCL's result on the same inputs and
   the expected values;
3. kernels: CUDA kernels the profiler sees per backend while its collectives run;
4. sweep (nccl-tests style, 8 B .. 1 GiB by factor 2): all_gather_into_tensor, all_to_all_single
   even and uneven; freescale IPC / direct / staged, NCCL default, NCCL zero-CTA copy engine
   (``nccl_ce``: NCCL_CTA_POLICY=2 plus buffers in NCCL symmetric windows); time (CUDA events,
   median over iterations, slowest rank), algbw, busbw = algbw * (n-1)/n, correctness per size;
5. overlap: a bf16 8192^3 matmul and a jagged (varlen) flash attention, replayed from a CUDA graph,
   timed alone and while each backend moves 64 / 256 MiB AllToAll / AllGather concurrently on
   every rank; each window between two without traffic in an order drawn anew each round, a
   control window for the method's noise, medians (``benchmarks/overlap_rounds.py``, shared
   with ``comm_gpu.py``), slowdown per backend and rank;
6. embed (from this parent process, between the phases): freescale_embed's own benchmark
   (``freescale_embed.bench.run_bench``, which starts its ranks itself) once with the freescale
   and once with the NCCL backend, where its BenchConfig can choose the backend; otherwise the
   JSON says why it was not run;
then, in a second set of processes (NCCL reads it once per process), NCCL with
NCCL_P2P_USE_CUDA_MEMCPY=1 (copy-engine P2P transport) for kernels, sweep and overlap.

What NCCL 2.28.9 offers (read from its source, tag v2.28.9-1, recorded in the JSON too):
``NCCL_CTA_POLICY`` / ``ncclConfig_t.CTAPolicy`` 0 default, 1 efficiency, 2 zero
(``NCCL_CTA_POLICY_ZERO`` is the constant, not a variable). With 2, AllGather and AlltoAll (the
``ncclAlltoAll`` API) run on copy engines when the communicator is single-node with symmetric
support and both buffers lie in windows registered with NCCL_WIN_COLL_SYMMETRIC
(src/enqueue.cc, src/ce_coll.cc); the policy changes nothing else, so the plain ``nccl`` backend
(cudaMalloc buffers) still runs NCCL's default kernels in the same process. Uneven AllToAll is
send/recv there: no copy-engine path.

Writes multi_gpu_vs_nccl.json (rewritten after every part), table.txt, and sweep.png /
overlap.png where matplotlib imports, under --out (default $OUT or out/multi_gpu); prints a short
table last. ``--dry-run`` runs the same structure on CPU (Gloo stands in for NCCL, tiny sizes).

    python benchmarks/multi_gpu_vs_nccl.py --out $OUT          # on the 2-GPU machine
    python benchmarks/multi_gpu_vs_nccl.py --dry-run            # anywhere, CPU only
    python benchmarks/multi_gpu_vs_nccl.py --share-gpu --out $OUT   # one GPU: freescale only

Modules, one part each: ``settings`` (phases, caps, targets, NCCL facts), ``sizes``, ``context``
(a rank's state and shared helpers), ``rank`` (a rank's side of a phase), ``phases`` (the
parent's side, on the launcher), ``environment`` / ``correctness`` / ``kernels`` / ``sweep`` /
``overlap`` (parts 1-5), ``embed`` (part 6), ``report`` (JSON, summary, table), ``plots``,
``cli`` (the command line and the run).
"""
