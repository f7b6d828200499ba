"""What `llm.offload_embeddings` costs a step: the lookup of a batch's rows in Llama-3's input embedding table
(128,256 x 4,096, bf16) kept in host memory and their copy to the device, against the table on the device.

    python3 benchmarks/host_embedding.py            # on a GPU: the copy to it included
    python3 benchmarks/host_embedding.py --tokens 8192 --calls 20

Rows: the table on the device (the reference), `HostEmbedding` as the trainer runs it on a GPU (a kernel on the
device reads the ids' rows from the pinned table, checked against the table), its host lookup (the rows looked up
into a reused pinned buffer, then copied), and the earlier form (the module's own lookup into a fresh tensor, then pinned); then
the host's share of a GPU run's lookup, which a CPU can time too: into a reused buffer, against a fresh tensor
copied once more (what pinning it did). On a CPU the first three rows only move the rows within host memory."""
from __future__ import annotations

import argparse

import torch
from timing import timed  # benchmarks/timing.py (this script's folder is on the path)

from sdxl_lora.llm.offload import HostEmbedding


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens a step (batch x length)")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    table = torch.nn.Embedding(args.vocab, args.hidden, dtype=torch.bfloat16).requires_grad_(False)
    ids = torch.randint(0, args.vocab, (1, args.tokens), device=device)
    rows = {}
    on_device = torch.nn.Embedding(args.vocab, args.hidden, dtype=torch.bfloat16, device=device).requires_grad_(False)
    rows["table on the device"] = timed(lambda: on_device(ids), args.calls, sync)
    del on_device
    host = HostEmbedding(table, device)
    cuda = device.type == "cuda"
    if cuda:  # the trainer's path on a GPU: the device reads the ids' rows from the pinned table
        assert host._direct and ids.device == host.target, "HostEmbedding would not take the device's path"
        assert torch.equal(host(ids).cpu(), table.weight[ids.cpu()]), "the device read other rows"
        rows["HostEmbedding (rows read by the GPU)"] = timed(lambda: host(ids), args.calls, sync)
        host._direct = False  # the host's lookup, as on a machine where the device cannot read host memory
    rows["HostEmbedding (host lookup, reused pinned buffer)"] = timed(lambda: host(ids), args.calls, sync)

    def earlier():
        looked_up = table(ids.to("cpu"))
        return looked_up.pin_memory().to(device, non_blocking=True) if cuda else looked_up.to(device)

    rows["earlier form (fresh tensor, then pinned)"] = timed(earlier, args.calls, sync)
    host_ids = ids.to("cpu").reshape(-1)
    buf = torch.empty((args.tokens, args.hidden), dtype=torch.bfloat16)
    rows["host only: lookup into a reused buffer"] = timed(
        lambda: torch.index_select(table.weight, 0, host_ids, out=buf), args.calls, lambda: None)
    rows["host only: fresh lookup, copied once more"] = timed(lambda: table(host_ids).clone(), args.calls, lambda: None)
    print(f"{args.tokens:,} tokens from a {args.vocab:,} x {args.hidden:,} bf16 table, {device} "
          f"({torch.cuda.get_device_name(device) if cuda else f'{torch.get_num_threads()} threads'}), "
          f"{args.calls} calls:")
    for name, ms in rows.items():
        print(f"  {name:50s} {ms:8.2f} ms a call")


if __name__ == "__main__":
    main()
