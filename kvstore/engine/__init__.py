"""The storage engine: the on-disk format, records, segments and their
lifecycle, the index, the tenant registry, recovery, compaction, retention,
and the Store that puts them together."""
