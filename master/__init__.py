"""Master: ingests, partitions into mini-buffers, distributes per epoch, reports (paper 003, IV-A/B)."""
