"""The Avazu CTR layout, defined once: ``id, click, hour, C1, banner_pos, ..., C21``, comma-separated.

Its training file has these 24 columns and a header naming them; its test file lacks the
``click`` column (23). Files may come without the header line. The reader and the format
hints take the layout from here.
"""

AVAZU_COLUMNS = (
    "id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id",
    "app_domain", "app_category", "device_id", "device_ip", "device_model", "device_type",
    "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21",
)
AVAZU_TEST_COLUMNS = tuple(c for c in AVAZU_COLUMNS if c != "click")  # Avazu's test file: nothing to predict
# The header line of each layout, and the columns it names.
AVAZU_HEADERS = {",".join(columns).encode(): columns for columns in (AVAZU_COLUMNS, AVAZU_TEST_COLUMNS)}
