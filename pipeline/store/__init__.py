"""The run folder, its one owner: the manifest (typed), the output-safety rules, the lock, Parquet parts (written
fsynced and content-addressed, verified on read, damaged ones set aside), and the utilities earlier runs wrote."""
