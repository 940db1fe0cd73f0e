"""The fleet: shards shared by every replica and learner through Redis Streams."""
