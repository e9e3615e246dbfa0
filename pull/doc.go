// Package pull guards the subscribers of Pub/Sub pull subscriptions
// (cloud.google.com/go/pubsub/v2's Subscriber.Receive) as package
// idempotency guards push subscribers: each message's work runs at most
// once to completion per key, across redeliveries, processes and
// instances, with the claim, lease and fence of the chosen store.
//
//	sub := client.Subscriber("orders-sub")
//	err := sub.Receive(ctx, pull.Handler(sub, backend, handle,
//		idempotency.WithKey(idempotency.Attribute("order_id"))))
//
// [Handler] translates each message into the CloudEvent a push
// subscription's delivery of it becomes, runs it through
// [idempotency.Idempotent], and acks or nacks the message by the
// outcome; [HandlerTx] does the same through [idempotency.IdempotentTx].
// It is a module of its own so that the root module does not depend on
// the Pub/Sub client. docs/pull.md has the outcome table and the
// settings of the subscription and of the client that matter.
package pull
