"""The router: accepts requests, tokenizes, asks the routing policy where to go, publishes the job."""
