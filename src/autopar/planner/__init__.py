"""AUTO_PARALLEL: capture the network as operators with shapes, cost every candidate strategy (compute,
communication, memory), search the whole graph, and run the chosen plan through the semi-auto machinery."""
