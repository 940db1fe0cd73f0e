"""The shard store: shards on disk (snapshots + journal) and its fleet outbox."""
