"""The bytes of the tiers below the pool: fixed-size slots in host memory or in a file on
local disk (never policy: which entry goes where is ``blockd.core.tiering``'s)."""
