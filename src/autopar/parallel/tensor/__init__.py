"""SEMI_AUTO_PARALLEL: operators with shard strategies run on their local shards; DTensor redistributes between
the layouts of a producer and a consumer; everything unannotated runs data-parallel."""
