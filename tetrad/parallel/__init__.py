"""Everything that talks to torch.distributed: the mesh of process groups (mesh.py), the counted
collectives (comm.py), and the parallel strategies' engines (data_parallel.py: DDP; zero.py,
zero_optimizer.py: ZeRO-1/2; fsdp.py: ZeRO-3). See docs/distributed.md."""
