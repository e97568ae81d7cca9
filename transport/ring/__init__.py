"""The one-sided ring buffer (DESIGN §5): the protocol in writer.py and reader.py, written once
against region.Region; backends shm.py (shm://), agent.py (ring+tcp://) and rdma.py (rdma://)."""
