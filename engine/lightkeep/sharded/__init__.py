"""Sharded training (FSDP2; optional reading unless you use ``configs/fsdp.yaml``): ``strategy.ShardedStrategy``
writes atomic DCP folders, one shard per rank; ``folders`` reads them without running code (the rest of the engine
uses it to find and resume from them, and export to consolidate them).
"""
