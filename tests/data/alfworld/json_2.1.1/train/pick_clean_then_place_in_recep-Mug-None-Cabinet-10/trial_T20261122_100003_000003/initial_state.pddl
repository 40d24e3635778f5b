(define (problem plan_trial_T20261122_100003_000003)
    (:domain alfred)
    (:objects
        agent1 - agent
        MugType - otype
        CounterTopType - rtype
        SinkBasinType - rtype
        CabinetType - rtype
        Mug_bar__plus_00_dot_33_bar__plus_00_dot_95_bar__minus_02_dot_12 - object
        CounterTop_bar__plus_00_dot_47_bar__plus_00_dot_95_bar__minus_01_dot_95 - receptacle
        Sink_bar__minus_01_dot_99_bar__plus_00_dot_90_bar__minus_01_dot_44_bar_SinkBasin - receptacle
        Cabinet_bar__minus_01_dot_85_bar__plus_02_dot_02_bar__plus_00_dot_38 - receptacle
        loc_bar_2_bar__minus_5_bar_2_bar_45 - location
        loc_bar__minus_5_bar__minus_4_bar_3_bar_60 - location
        loc_bar__minus_5_bar_1_bar_3_bar__minus_30 - location
        loc_bar_0_bar_0_bar_1_bar_30 - location
        )
    (:init
        (receptacleType CounterTop_bar__plus_00_dot_47_bar__plus_00_dot_95_bar__minus_01_dot_95 CounterTopType)
        (receptacleType Sink_bar__minus_01_dot_99_bar__plus_00_dot_90_bar__minus_01_dot_44_bar_SinkBasin SinkBasinType)
        (receptacleType Cabinet_bar__minus_01_dot_85_bar__plus_02_dot_02_bar__plus_00_dot_38 CabinetType)
        (objectType Mug_bar__plus_00_dot_33_bar__plus_00_dot_95_bar__minus_02_dot_12 MugType)
        (canContain CounterTopType MugType)
        (canContain SinkBasinType MugType)
        (canContain CabinetType MugType)
        (openable Cabinet_bar__minus_01_dot_85_bar__plus_02_dot_02_bar__plus_00_dot_38)
        (pickupable Mug_bar__plus_00_dot_33_bar__plus_00_dot_95_bar__minus_02_dot_12)
        (cleanable Mug_bar__plus_00_dot_33_bar__plus_00_dot_95_bar__minus_02_dot_12)
        (heatable Mug_bar__plus_00_dot_33_bar__plus_00_dot_95_bar__minus_02_dot_12)
        (coolable Mug_bar__plus_00_dot_33_bar__plus_00_dot_95_bar__minus_02_dot_12)
        (atLocation agent1 loc_bar_0_bar_0_bar_1_bar_30)
        (receptacleAtLocation CounterTop_bar__plus_00_dot_47_bar__plus_00_dot_95_bar__minus_01_dot_95 loc_bar_2_bar__minus_5_bar_2_bar_45)
        (receptacleAtLocation Sink_bar__minus_01_dot_99_bar__plus_00_dot_90_bar__minus_01_dot_44_bar_SinkBasin loc_bar__minus_5_bar__minus_4_bar_3_bar_60)
        (receptacleAtLocation Cabinet_bar__minus_01_dot_85_bar__plus_02_dot_02_bar__plus_00_dot_38 loc_bar__minus_5_bar_1_bar_3_bar__minus_30)
        (inReceptacle Mug_bar__plus_00_dot_33_bar__plus_00_dot_95_bar__minus_02_dot_12 CounterTop_bar__plus_00_dot_47_bar__plus_00_dot_95_bar__minus_01_dot_95)
        (objectAtLocation Mug_bar__plus_00_dot_33_bar__plus_00_dot_95_bar__minus_02_dot_12 loc_bar_2_bar__minus_5_bar_2_bar_45)
        )
    (:goal
        (and
            (exists (?r - receptacle)
                (exists (?o - object)
                    (and
                        (cleanable ?o)
                        (objectType ?o MugType)
                        (receptacleType ?r CabinetType)
                        (isClean ?o)
                        (inReceptacle ?o ?r)
                    )
                )
            )
        )
    )
)
