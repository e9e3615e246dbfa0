package datastorelock

// KeyOf exposes keyOf, the inverse of Name, to the tests.
var KeyOf = keyOf
