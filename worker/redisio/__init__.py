"""Redis plumbing shared by the worker's packages: clients, Lua script loading, receipts."""
