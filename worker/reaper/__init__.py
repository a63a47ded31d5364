"""The host-local reaper: ends lapsed leases and kills the trees they named."""
