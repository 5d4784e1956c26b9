"""tpgraph-tune: measure the all-reduce algorithms on this machine and rewrite its table rows."""
