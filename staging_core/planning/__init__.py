"""The cost model and what feeds it: inventories, link profiles and the local route's costs."""
