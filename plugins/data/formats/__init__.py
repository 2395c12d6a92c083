"""Record formats (data.format): one file each registers its RecordFormat (spec.py: what the data code asks of it).
plugins/data/__init__.py imports the built-in ones (not this package: the readers import spec.py, and the formats
import the readers)."""
