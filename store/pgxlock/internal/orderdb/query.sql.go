package orderdb

import (
	"context"
)

const countShipments = `-- name: CountShipments :one
SELECT count(*) FROM shipments WHERE order_id = $1
`

// CountShipments counts an order's shipment rows.
func (q *Queries) CountShipments(ctx context.Context, orderID string) (int64, error) {
	row := q.db.QueryRow(ctx, countShipments, orderID)
	var count int64
	err := row.Scan(&count)
	return count, err
}

const insertShipment = `-- name: InsertShipment :exec
INSERT INTO shipments (order_id, item) VALUES ($1, $2)
`

// InsertShipmentParams are InsertShipment's parameters.
type InsertShipmentParams struct {
	OrderID string
	Item    string
}

// InsertShipment adds one shipment row.
func (q *Queries) InsertShipment(ctx context.Context, arg InsertShipmentParams) error {
	_, err := q.db.Exec(ctx, insertShipment, arg.OrderID, arg.Item)
	return err
}
